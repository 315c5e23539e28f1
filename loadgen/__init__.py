"""Load generator for multi-turn agentic workloads (offline rollouts and online SLO runs).

Entry points: ``loadgen.cli.main(argv)`` (``dualpath loadgen``),
``dualpath.bench.loadgen.run_overhead_bench`` (``dualpath bench loadgen``) and
``python -m loadgen.instant_server`` (a server that answers at once, for measuring clients).
Trajectories: ``loadgen.trajectory`` (JSONL format), ``loadgen.synthetic`` (the paper's
32K/48K/64K sets); arrivals: ``loadgen.arrivals``; the run itself: ``loadgen.runner``.
"""
