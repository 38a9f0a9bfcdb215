"""Evidence: the aggregate a campaign's raw files produce under the frozen calculator, and its
byte-for-byte re-derivation."""
