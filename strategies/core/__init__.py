"""What every scheme shares, and nothing scheme-specific.

The round loop and its phases, the node table, the round record, resume checks, the
attack observer, talking to the SuperLink, the Aggregator seam (bounded mean, robust
aggregators, group models), reply validation, the client lifecycle and the scheme
registry. Nothing here imports a scheme; schemes import from here.
"""
