"""Model adapters: one module per family behind `models.base.DuplexModel`."""
