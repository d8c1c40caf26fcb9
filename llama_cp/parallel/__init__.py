"""The process layout: the device mesh and its groups (mesh), splitting a sequence over cp ranks
(sharding), and the collectives under their names on every admitted torch (collectives)."""
