"""A plan of fixed sizes: the build resolved once (resolve.py: every input read and checked;
``Resolved.with_sizes`` for other sizes), graph keys, the capture order, each phase's strategy,
and the pipeline that predicts and assembles the sealed plan."""
