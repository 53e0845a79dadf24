"""Everything that knows SGLang: the prefix-cache backend, its factory and the hooks."""
