"""Scheduling a plan: graph keys, the capture order, each phase's strategy, and the pipeline that assembles the plan."""
