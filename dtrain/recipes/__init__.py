"""The shipped recipes: ``--recipe NAME`` reads ``NAME.toml`` from this package (see
``dtrain.config.find_recipe``)."""
