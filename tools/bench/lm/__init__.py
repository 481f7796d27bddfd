"""The time-to-loss workload (``python -m tools.bench --workload lm``): how fast a small byte-level
language model reaches a validation loss, per communication variant, on the same hosts.

One unit per concern, so later workloads (DiLoCo, slow hosts) reuse the pieces:

- ``data``     the corpus (the standard library's own source files), its held-out split, batches;
- ``model``    the byte-level transformer;
- ``variants`` what is compared: each variant is a backend plus environment, checked before a run;
- ``train``    one rank's training loop (``python -m tools.bench.lm.train '<json plan>'``);
- ``runner``   the harness: corpus, calibration of the link rate, fleet, one run per variant;
- ``report``   curves JSON, the loss plot and the Markdown table;
- ``cli``      the command line.

Only ``train`` and ``model`` import torch; the harness side does not (``data`` uses only the
standard library until a rank asks it for tensors).
"""
