//! The fixtures made by Google's and the official scripts carry their SHA-256 in their READMEs:
//! every file is listed with its digest, and nothing listed is missing. (Tried: a byte added
//! to a fixture fails it.)

#[test]
fn every_fixture_file_has_its_sha256_in_its_readme() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    assert_eq!(bertkit_test_support::check_fixture_digests(&root), 3);
}
