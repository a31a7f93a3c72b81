"""Profile stage: measure one training iteration node by node (interpreter.py) with memory trackers (memory.py)."""
