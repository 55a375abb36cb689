"""One model over several processes of one host (DESIGN §13): experts partitioned (expert
parallel), attention heads split (tensor parallel), rank 0 serving and the others following its
steps. `shard` says what a rank holds, `group` moves rows between the ranks, `lockstep` keeps
the followers' runners in step with rank 0's."""
