"""The single weight path: every load, reload and transport update is a `WeightSource` applied by one
`WeightUpdate` (both in update.py) through the worker's `WeightSession` (session.py), landing on the targets of
the model's `WeightIndex` (index.py) through each module's `ShardedWeights` layout (sharded.py)."""
