"""mpifl: multi-domain federated learning simulated over MPI.

Rank 0 is the server, every other rank hosts a fixed set of logical clients.
See README.md (usage) and docs/ (design.md: how a run works; methods.md: each method's choices).
"""

__version__ = "0.1.0"
