//! Warren's cluster: Raft groups on openraft between `warren serve` nodes (docs/cluster.md).
