"""`raytrain-ddp sweep`: hyperparameter search on Ray Tune, every trial a full fit of ours.

`config/sweep.py` types the `sweep:` section and checks its space before Ray starts;
`run.py` drives Tune (searcher, ASHA, budget, trials at once, resume); `trial.py` is one
trial (a Tune class trainable around our launcher); `report.py` reads a sweep
directory back (table, curves, best config). Nothing here is imported by `train`.
"""
