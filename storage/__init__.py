"""Storage: ORM models, engine factory, queries, and the TrainingSample contract."""
