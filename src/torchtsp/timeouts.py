"""The default time limits, one per kind of wait, each with the reason for its size (torch-free: the flags'
help quotes them). A limit turns a hang into a clear error; it is never what a correct run waits for."""

# A collective of train or generate (an all-reduce, a ring step, a barrier): a rank that waits this long for the
# others has lost one (hung or dead). The longest wait of a correct run is the slowest work between two
# collectives on another rank: a checkpoint written to a slow disk, a first step allocating a large model.
COLLECTIVE_TIMEOUT_S = 300.0

# A server's ranks: a decode step takes well under a second, so a minute without an answer is a hung rank, and
# failing the server then (503, requests fail) beats holding every client for the collective limit.
SERVE_TIMEOUT_S = 60.0

# One cell of bench (a scheme at a sequence length, all ranks): warm-up, the memory step and the timed steps
# together, the longest of them at the sweep's longest S on loaded CPU ranks; its collectives share the limit.
BENCH_CELL_TIMEOUT_S = 600.0

# SIGTERM to a server: how long its running requests may still finish. Supervisors kill a process that has not
# exited some time after SIGTERM (Kubernetes: 30 s by default); this grace, plus the ranks' stop and the last
# answers' writing, stays well inside that, while a typical answer of a few hundred tokens still completes.
SHUTDOWN_GRACE_S = 10.0
