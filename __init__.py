"""capture-plan: plan, predict and execute CUDA-graph capture for LLM serving engines.

One import root; its subpackages, in layers (each may import only those
before it; tests/test_import_layers.py checks it):

- ``capture_plan.schemas``: the msgspec types both sides share (spec, plan,
  trace, report, errors). Neither torch nor networkx.
- ``capture_plan.planner``: spec and rules to a checked-in plan, CPU only;
  never imports torch. The ``planner`` command.
- ``capture_plan.executor``: what an engine imports at start-up (torch):
  load a plan, capture as planned, replay, verify, report.
- ``capture_plan.adapters``: CaptureTargets for engines' and libraries' model
  code (transformers); above the executor, which never imports them.
- ``capture_plan.references``: the project's own reference models, the
  speculative reference and its planted bugs, for tests, benchmarks and
  calibration. Not imported by the executor.

In the repository these are the top-level folders ``schemas/``, ``planner/``,
``executor/``, ``adapters/`` and ``references/``, and this file is the root
package's ``__init__``: pyproject.toml maps them (``[tool.setuptools.package-dir]``),
so the code runs from an install (``pip install -e .`` in a checkout), never
from the folders put on ``sys.path`` by hand.
"""

#: the distribution's version (pyproject.toml reads it from here)
__version__ = "0.1.0"
