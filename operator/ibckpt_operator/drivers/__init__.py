"""The drivers: each runs one object's machine against the cluster (a CheckpointJob's, a RestoreJob's, a
CheckpointSchedule's), from its status, and turns the machine's actions into cluster calls (cluster/)."""
