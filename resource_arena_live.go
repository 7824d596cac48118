package rmm

// The arena's index of live allocations: pointer → (superblock, size asked). A block up to 1 MiB
// is in the own table of the arena that holds its superblock (arenaSet.live), under that arena's
// lock, which its allocation and a free on the arena's stream take anyway; when the superblock
// goes back to the global arena with the block still live, the entry moves to a shard chosen by
// the 1 MiB range of the arena the block lies in (liveShard), each shard under its own lock.
// Blocks above 1 MiB are in one table, kept at most half full, under the global arena's lock.
// Each is a liveTable (live_table.go).

// arenaLiveTable is a table of live allocations of the arena (live_table.go).
type arenaLiveTable = liveTable[arenaLive]
