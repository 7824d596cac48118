package rmm

// The arena's index of live allocations: pointer → (superblock, size asked). Blocks up to 1 MiB
// are sharded by the 1 MiB range of the arena they lie in (liveShard), each shard under its own
// lock; blocks above 1 MiB are in one table, kept at most half full, under the global arena's
// lock. Each is a liveTable (live_table.go).

// arenaLiveTable is a table of live allocations of the arena (live_table.go).
type arenaLiveTable = liveTable[arenaLive]
