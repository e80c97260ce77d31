"""`planner fit`: a device's memory budget for one engine release and its settings (CPU only)."""
