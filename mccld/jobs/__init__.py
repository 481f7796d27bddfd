"""mccld's jobs: one Job per training job on this host, the collectives it runs (local
reduce, pipelined cross-host phases, the fast path) and its point-to-point mailbox."""
