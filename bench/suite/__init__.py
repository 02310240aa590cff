"""`make bench` (`python -m bench.suite.run`): the blocks of the one JSON report, its baselines
(transformers, transformers+peft) and the report itself."""
