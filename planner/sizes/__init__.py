"""Capture sizes chosen for a traffic: step times, the front of padding against memory and
start-up, each list priced on the resolved build in memory, and what a choice records in its plan."""
