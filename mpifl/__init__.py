"""mpifl: multi-domain federated learning simulated over MPI.

Rank 0 is the server, every other rank hosts a fixed set of logical clients.
See README.md: usage, How a run works, DESIGN notes.
"""

__version__ = "0.1.0"
