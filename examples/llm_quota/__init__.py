"""Per-tenant limit + shared provider limit + token budget, against the mock provider."""
