"""The job as a whole, on every rank: the command line (its options and the one list of what a resumed run may
change), setting up the ranks, running each one's role, and ending the job with one line on a failure."""
