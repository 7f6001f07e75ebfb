//! The fixtures made by Google's and the official scripts carry their SHA-256 in their READMEs:
//! every file is listed with its digest, and nothing listed is missing. (Tried: a byte added
//! to a fixture fails it.)

use std::path::{Path, PathBuf};

use bertkit_test_support::sha256_file;

fn files_under(dir: &Path, base: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, base, out);
        } else {
            out.push(
                path.strip_prefix(base)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
}

#[test]
fn every_fixture_file_has_its_sha256_in_its_readme() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut folders = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let folder = entry.unwrap().path();
        let readme = std::fs::read_to_string(folder.join("README.md")).unwrap();
        let section = readme
            .split("## SHA-256")
            .nth(1)
            .unwrap_or_else(|| panic!("{}: no SHA-256 section", folder.display()));
        let mut listed: Vec<(String, String)> = section
            .lines()
            .filter_map(|l| l.split_once("  "))
            .filter(|(sha, _)| sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(|(sha, file)| (file.to_string(), sha.to_string()))
            .collect();
        listed.sort();
        let mut files = Vec::new();
        files_under(&folder, &folder, &mut files);
        files.retain(|f| f != "README.md");
        files.sort();
        let actual: Vec<(String, String)> = files
            .iter()
            .map(|f| (f.clone(), sha256_file(folder.join(f))))
            .collect();
        assert_eq!(listed, actual, "{}", folder.display());
        folders += 1;
    }
    assert_eq!(folders, 3);
}
