//! The TCP rendezvous of multi-process runs (no GPU needed): ranks as threads exchanging
//! NCCL-id-sized blobs, gathers, barriers, and the errors a misconfigured launch gets.

use hzp_runtime::cuda::rendezvous::{DistEnv, Rendezvous};
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn env(rank: usize, world: usize, port: u16) -> DistEnv {
    DistEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

#[test]
fn ranks_receive_rank0s_ids_and_gather_in_rank_order() {
    let world = 4;
    let port = free_port();
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                // later ranks start first: they must retry until rank 0 listens
                if r == 0 {
                    std::thread::sleep(Duration::from_millis(150));
                }
                let mut rv = Rendezvous::connect(&env(r, world, port), Duration::from_secs(20))
                    .expect("connect");
                let ids: Vec<u8> = (0..3 * 128).map(|i| (i * 7 % 251) as u8).collect();
                let got = if r == 0 {
                    rv.broadcast(Some(&ids)).unwrap()
                } else {
                    rv.broadcast(None).unwrap()
                };
                assert_eq!(got, ids, "rank {r}");
                let mine = format!("rank-{r}").repeat(r + 1);
                let all = rv.all_gather(mine.as_bytes()).unwrap();
                rv.barrier().unwrap();
                all
            })
        })
        .collect();
    for h in handles {
        let all = h.join().unwrap();
        assert_eq!(all.len(), world);
        for (r, a) in all.iter().enumerate() {
            assert_eq!(a, format!("rank-{r}").repeat(r + 1).as_bytes());
        }
    }
}

#[test]
fn a_rank_with_another_world_size_is_refused_by_name() {
    let port = free_port();
    let r0 = std::thread::spawn(move || {
        Rendezvous::connect(&env(0, 2, port), Duration::from_secs(10)).map(|_| ())
    });
    let r1 = Rendezvous::connect(&env(1, 3, port), Duration::from_secs(10)).map(|_| ());
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    let e1 = r1.unwrap_err().to_string();
    assert!(
        e0.contains("WORLD_SIZE=3") && e0.contains("WORLD_SIZE=2"),
        "{e0}"
    );
    assert!(e1.contains("refused") && e1.contains("WORLD_SIZE"), "{e1}");
}

#[test]
fn a_missing_rank_0_times_out_with_the_address() {
    let port = free_port();
    let e = Rendezvous::connect(&env(1, 2, port), Duration::from_millis(300))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("could not reach rank 0") && e.contains(&format!("127.0.0.1:{port}")),
        "{e}"
    );
    // and rank 0 alone names the ranks that never came
    let e = Rendezvous::connect(&env(0, 3, port), Duration::from_millis(300))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank(s) 1, 2 of 3"), "{e}");
}

#[test]
fn torchrun_variables_are_read_and_checked() {
    let from = |pairs: &[(&str, &str)]| {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(&move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    };
    assert_eq!(from(&[]).unwrap(), DistEnv::single());
    let e = from(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29400"),
    ])
    .unwrap();
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (3, 8, 1, 2)
    );
    assert_eq!(e.master(), "node0:29400");
    for (bad, word) in [
        (vec![("RANK", "2"), ("WORLD_SIZE", "2")], "RANK=2"),
        (vec![("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
        (vec![("RANK", "0")], "WORLD_SIZE"),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")],
            "MASTER_PORT",
        ),
        (vec![("LOCAL_RANK", "0")], "hzp launch"),
    ] {
        let err = from(&bad).unwrap_err();
        assert!(err.contains(word), "{bad:?}: {err}");
    }
}
