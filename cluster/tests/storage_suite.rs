//! openraft's own conformance suite for storage (`openraft::testing::Suite`: log state,
//! append, truncate, purge, vote, membership, apply, snapshot build and install) run
//! against Warren's redb log store and state machine adapter.

use openraft::StorageError;
use openraft::testing::{StoreBuilder, Suite};
use warren_cluster::definitions::Definitions;
use warren_cluster::log_store::LogStore;
use warren_cluster::state_machine::StateMachineStore;
use warren_cluster::{NodeId, TypeConfig};

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore<Definitions>, tempfile::TempDir>
    for Builder
{
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachineStore<Definitions>), StorageError<NodeId>>
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = LogStore::open(&dir.path().join("meta.redb")).expect("log");
        let sm =
            StateMachineStore::open(Some(&dir.path().join("meta.snapshot")), Definitions::new())
                .expect("state machine");
        Ok((dir, log, sm))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(Builder).expect("openraft's storage suite");
}
