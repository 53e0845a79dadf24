"""Storage tiers below the device KV pool: host DRAM chunk slots (and, later, SSD)."""
