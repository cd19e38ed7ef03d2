"""What every rank derives alike from the configuration, without talking: the resolved options and their
vocabulary, the logical clients and their placement on ranks, the seeded random streams, the task and its
losses, and input normalization."""
