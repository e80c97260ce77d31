"""The benchmarks: scripts run from the repository root after ``pip install -e .``, as
``python -m bench.<name>`` (``python -m bench.capture_bench --help``).

A package of the repository, not of the wheel (pyproject.toml's packages list leaves it
out): it imports ``capture_plan`` from the installation and its own shared pieces from
:mod:`bench.harness`; nothing here edits ``sys.path``. Results go to ``bench/results/``.
"""
