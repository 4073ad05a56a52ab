"""The single weight path: every load, reload and transport update is a `WeightSource` (sources.py) applied by
one `WeightUpdate` (update.py) through the worker's `WeightSession` (session.py), landing on the targets of the
model's `WeightIndex` (index.py) through each module's `ShardedWeights` layout (sharded.py)."""
