"""A client rank, host of a fixed set of logical clients: the host loop, local training and evaluation,
the clients' data on the device, augmentations, private state, precision and devices."""
