"""What every rank builds alike from the configuration, without talking: the session (initial model,
algorithm, wire layouts, one-time exchanges) and the round protocol that says what each rank does in a round."""
