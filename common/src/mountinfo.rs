//! `/proc/self/mountinfo` (and `/proc/mounts`), as the pmem layer and the initiator's mount
//! read them: fields with their octal escapes undone, and the mount a path lies under.

use std::path::Path;

/// A field with its octal escapes (`\040` for a space, `\134` for a backslash) undone.
pub fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') << 6 | (d[1] - b'0') << 3 | (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount `path` (canonical) lies under, from the text of /proc/self/mountinfo: the one
/// whose mount point is the longest prefix of it (by path components; of several on one
/// point, the last listed, mounted over the others): its filesystem type and super options.
pub fn mount_over<'a>(mountinfo: &'a str, path: &Path) -> Option<(&'a str, &'a str)> {
    // "id parent maj:min root mountpoint options [optional...] - fstype source super-options"
    let mut best: Option<(usize, &str, &str)> = None;
    for line in mountinfo.lines() {
        let Some((mount, rest)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = mount.split(' ').nth(4).map(unescape) else {
            continue;
        };
        if !path.starts_with(&point) {
            continue;
        }
        let depth = Path::new(&point).components().count();
        if best.is_none_or(|(d, _, _)| depth >= d) {
            let mut fields = rest.split(' ');
            let fstype = fields.next().unwrap_or("");
            let options = fields.nth(1).unwrap_or("");
            best = Some((depth, fstype, options));
        }
    }
    best.map(|(_, fstype, options)| (fstype, options))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_are_undone_and_the_deepest_mount_over_a_path_is_found() {
        assert_eq!(unescape("a\\040b\\134c\\9"), "a b\\c\\9");
        assert_eq!(unescape("a\\134b\\04"), "a\\b\\04");
        let text = "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
            30 22 0:40 / /srv/a\\040b rw - tmpfs tmpfs rw,size=1k\n\
            31 30 0:41 / /srv/a\\040b rw - overlay overlay rw,upperdir=/u\n";
        assert_eq!(
            mount_over(text, Path::new("/srv/a b/f")),
            Some(("overlay", "rw,upperdir=/u"))
        );
        assert_eq!(
            mount_over(text, Path::new("/srv/a bc/f")),
            Some(("ext4", "rw"))
        );
        assert_eq!(mount_over("", Path::new("/x")), None);
    }
}
