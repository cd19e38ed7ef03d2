"""The process: how it was launched (the MPI world), ending the whole job from any rank, stop signals, and
the test-only fault injector.  The ground floor of the runtime: it imports nothing else of mpifl."""
