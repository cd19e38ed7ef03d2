"""How ranks talk: the communicator (MPI, or in-process threads), node topology, the byte layouts of
the round's messages, reused message buffers, one-time exchanges and GPU message buffers."""
