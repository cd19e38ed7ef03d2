"""What every rank derives alike from the configuration, without talking: the resolved options, the
logical clients and their placement on ranks, the seeded random streams, the session (initial model and
algorithm) and the round protocol that says what each rank does in each round."""
