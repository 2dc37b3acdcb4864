//! `rpma-initiator nbd` against a real `rpma-target`, driven by the NBD clients people use:
//! qemu-io, qemu-img, nbdinfo, nbdcopy, fio's nbd engine.
//!
//! A test whose client is not installed says SKIPPED (scripts/install-deps.sh installs them).

use std::process::Command;
use std::time::Duration;

use rpma_tests::nbd::*;
use rpma_tests::{noise as pattern, run_with_deadline, text};

// ---- third-party clients ----

#[test]
fn qemu_io_across_block_boundaries_and_the_cli_see_the_same_bytes() {
    if !have("qemu-io") {
        return;
    }
    let (_d, _shm, t) = start("qemuio");
    let e = Export::start(&t, 1, "qemuio", &[]);
    let uri = e.uri();
    // 10000 bytes from 1000: partial first and last 4096-byte blocks (qemu reads, modifies,
    // writes them back), FUA on one write, then a flush.
    let out = tool(Command::new("qemu-io").args([
        "-f",
        "raw",
        &uri,
        "-c",
        "write -P 0x5a 1000 10000",
        "-c",
        "write -f -P 0x5b 20000 100",
        "-c",
        "write -P 0x5c 30000 9000",
        "-c",
        "write -z 32768 4096",
        "-c",
        "flush",
        "-c",
        "read -P 0x5a 1000 10000",
        "-c",
        "read -P 0x5c 30000 2768",
        "-c",
        "read -P 0 32768 4096",
        "-c",
        "read -P 0x5c 36864 2136",
        "-c",
        "read -P 0x5b 20000 100",
        "-c",
        "read -P 0 0 1000",
        "-c",
        "read -P 0 11000 9000",
    ]));
    assert!(!out.contains("verification failed"), "{out}");
    // The same bytes through the library's own CLI.
    let b = cli_read(&t, 1, 0, 49152);
    assert!(b[..1000].iter().all(|&x| x == 0));
    assert!(b[1000..11000].iter().all(|&x| x == 0x5a));
    assert!(b[11000..20000].iter().all(|&x| x == 0));
    assert!(b[20000..20100].iter().all(|&x| x == 0x5b));
    assert!(b[20100..30000].iter().all(|&x| x == 0));
    let z = &b[30000..];
    assert!(z[..2768].iter().all(|&x| x == 0x5c) && z[6864..9000].iter().all(|&x| x == 0x5c));
    assert!(z[2768..6864].iter().all(|&x| x == 0), "WRITE_ZEROES");
    assert!(z[9000..].iter().all(|&x| x == 0));
    // And the reverse: the CLI writes, qemu-io reads.
    cli(
        &t,
        1,
        &[
            "write",
            "--offset",
            "40000",
            "--pattern",
            "0x77",
            "--length",
            "5000",
        ],
    );
    let out = tool(Command::new("qemu-io").args([
        "-f",
        "raw",
        &uri,
        "-c",
        "read -P 0x77 40000 5000",
        "-c",
        "read -P 0 45000 3000",
    ]));
    assert!(!out.contains("verification failed"), "{out}");
    // A mismatch is seen: the check above can fail.
    let o = run_with_deadline(
        Command::new("qemu-io").args(["-f", "raw", &uri, "-c", "read -P 0x77 39999 2"]),
        WAIT,
    );
    assert!(text(&o).contains("verification failed"), "{}", text(&o));
}

#[test]
fn qemu_img_convert_compare_and_nbdcopy_round_trip() {
    if !have("qemu-img") || !have("nbdcopy") {
        return;
    }
    let (d, _shm, t) = start("convert");
    let e = Export::start(&t, 1, "convert", &[]);
    let uri = e.uri();
    let src = d.path().join("src.img");
    let img = pattern(1, NS1 as usize);
    std::fs::write(&src, &img).unwrap();
    let s = src.to_str().unwrap();
    tool(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw", s, &uri]));
    tool(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", s, &uri]));
    assert!(
        cli_read(&t, 1, 0, NS1) == img,
        "bytes written over NBD differ in `read`"
    );

    // The CLI writes, nbdcopy reads (export -> file), a changed file goes back (file ->
    // export), and the CLI reads it.
    let two = pattern(2, 3 << 20);
    cli_write(&t, 1, 1 << 20, &two);
    let copy = d.path().join("copy.img");
    let c = copy.to_str().unwrap();
    tool(Command::new("nbdcopy").args([&uri, c]));
    let mut back = std::fs::read(&copy).unwrap();
    assert!(back[..1 << 20] == img[..1 << 20]);
    assert!(
        back[1 << 20..4 << 20] == two[..],
        "bytes the CLI wrote differ over NBD"
    );
    assert!(back[4 << 20..] == img[4 << 20..]);
    for (i, b) in back.iter_mut().enumerate().step_by(4093) {
        *b = b.wrapping_add(i as u8 | 1);
    }
    std::fs::write(&copy, &back).unwrap();
    tool(Command::new("nbdcopy").args([c, &uri]));
    assert!(cli_read(&t, 1, 0, NS1) == back, "nbdcopy file -> export");
    // qemu-img compare sees a difference too (the comparison can fail).
    let o = run_with_deadline(
        Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", s, &uri]),
        WAIT,
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

#[test]
fn nbdinfo_reports_size_block_sizes_and_honest_flags() {
    if !have("nbdinfo") {
        return;
    }
    let (_d, _shm, t) = start("info");
    // nsid 1 over TCP, nsid 2 (read-only) over a Unix socket.
    let addr = format!("127.0.0.1:{}", rpma_tests::free_port());
    for (nsid, size, block, ro) in [(1, NS1, 4096, false), (2, 1u64 << 20, 512, true)] {
        let args: &[&str] = if nsid == 1 { &["--listen", &addr] } else { &[] };
        let e = Export::start(&t, nsid, &format!("info{nsid}"), args);
        let out = run_with_deadline(Command::new("nbdinfo").args(["--json", &e.uri()]), WAIT);
        assert!(out.status.success(), "{}", text(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let x = &v["exports"][0];
        assert_eq!(x["export-name"], "rpma");
        assert_eq!(x["export-size"], size, "{x}");
        assert_eq!(x["block_size_minimum"], block, "{x}");
        assert_eq!(x["block_size_preferred"], 4096, "{x}");
        assert_eq!(x["block_size_maximum"], 32 << 20, "{x}");
        assert_eq!(x["is_read_only"], ro, "{x}");
        assert_eq!(x["can_flush"], !ro, "{x}");
        assert_eq!(x["can_fua"], !ro, "{x}");
        assert_eq!(x["can_zero"], !ro, "{x}");
        assert_eq!(x["can_multi_conn"], true, "{x}");
        assert_eq!(x["can_trim"], false, "{x}");
        assert_eq!(v["structured"], false, "{v}");
    }
}

#[test]
fn fio_nbd_randwrite_with_crc32c_verify_at_depth_8() {
    if !have("fio") {
        return;
    }
    let (d, _shm, t) = start("fio");
    let e = Export::start(&t, 1, "fio", &[]);
    let o = run_with_deadline(
        Command::new("fio").current_dir(d.path()).args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", e.uri()),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            "--size=4M",
            "--verify=crc32c",
            "--do_verify=1",
            "--output-format=json",
        ]),
        Duration::from_secs(50),
    );
    assert!(o.status.success(), "{}", text(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    // fio may print notes before the JSON.
    let v: serde_json::Value = serde_json::from_str(&s[s.find('{').unwrap()..]).unwrap();
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert_eq!(job["write"]["io_bytes"], 4 << 20, "{job}");
    assert_eq!(
        job["read"]["io_bytes"],
        4 << 20,
        "verify read everything back: {job}"
    );
    e.log_line(" in flight;");
    let most = e
        .log()
        .lines()
        .filter_map(|l| l.split("at most ").nth(1))
        .filter_map(|l| l.split(' ').next()?.parse::<usize>().ok())
        .max();
    assert!(most > Some(1), "depth 8 issued one at a time: {}", e.log());
}

rpma_tests::rdma_runs!(
    qemu_io_across_block_boundaries_and_the_cli_see_the_same_bytes,
    qemu_img_convert_compare_and_nbdcopy_round_trip,
    nbdinfo_reports_size_block_sizes_and_honest_flags,
    fio_nbd_randwrite_with_crc32c_verify_at_depth_8,
);
