"""The job as a whole, on every rank: the command line, setting up the ranks, running each one's role,
the run directory and checkpoints, stopping on a signal and ending the job on a failure."""
