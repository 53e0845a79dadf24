"""Moving KV between SGLang's device KV pool and PCR's host chunk slots."""
