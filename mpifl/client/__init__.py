"""A client rank, host of a fixed set of logical clients: the host loop, local training and evaluation,
the clients' data on the device, input normalization (FedRDN), augmentations, precision and devices."""
