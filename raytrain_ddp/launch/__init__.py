"""How a fit's ranks start: the launcher table (`table.py`), one row per way."""
