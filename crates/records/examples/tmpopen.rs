fn main() {
    for p in std::env::args().skip(1) {
        let t = std::time::Instant::now();
        match bertkit_records::reader::RecordsFile::open(std::path::Path::new(&p)) {
            Err(e) => println!("open: {e}"),
            Ok(f) => {
                let mut n = 0;
                for g in 0..f.row_group_rows().len() {
                    n += f.read_row_group(g).unwrap().len();
                }
                println!("{p}: {n} rows");
            }
        }
        println!("{:?}", t.elapsed());
    }
}
