"""Choosing capture sizes for a traffic: step times, the front of padding against memory and start-up."""
