"""Profile stage: measure one training iteration node by node (interpreter.py): its memory with
trackers (memory.py), its time with a timed copy of each graph (timed.py)."""
