"""The database layer: typed ORM models, async repositories, migrations. See docs/store.md."""
