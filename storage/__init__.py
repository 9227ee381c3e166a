"""Storage: ORM models, engine factory, queries, and the TrainingSample contract.

config.StorageConfig → engine.create_engine / create_sessionmaker; migrate.upgrade builds the schema and
migrate.ensure_schema checks it at every entry point; keys hashes API keys (KeyHasher, its secret) and
finds, lists and revokes them; queries (proxy and finalizer writes) and claims (claim_batch → record_step)
take the session factory;
records holds the narrow records passed between stages; packing the bit-exact array buffers.
"""
