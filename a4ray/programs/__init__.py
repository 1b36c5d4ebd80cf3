"""The programs a launch's ranks run under torchrun (the DDP test, the collectives benchmark), and how they
join and leave their process group.

Kept free of imports: every rank imports this package, and must not pay for Ray.
"""
