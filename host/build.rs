// The host embeds `migrations/` (`sqlx::migrate!`): a migration added without another change
// must still rebuild it.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
