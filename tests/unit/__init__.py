"""Fast tests of one part each: layering, registries, scheduler, tokenizer, CLI, README, packaging."""
