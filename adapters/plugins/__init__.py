"""Engine plugins: SGLang (``sglang.srt.plugins``) and vLLM (``vllm.general_plugins``)
entry points that route the engine's own capture through a capture plan.

Layout: :mod:`.hooks` (the engines' hook points, typed data), :mod:`.contract` (those
checked against a released wheel), :mod:`.core` (engine-neutral: the setting, the
plan, the refusals), and one thin module per engine. Importing this package imports
neither torch nor an engine.
"""
